"""Kernel-vs-reference tests that need TRITON_INTERPRET=1 set before triton is first imported.

In the main test process triton is usually already imported (DeepSpeed, the loss kernels), so
these modules are collected only inside the fresh subprocess that
tests/decoding/test_triton_interpreted.py starts with the variable set.
"""

import os

collect_ignore_glob = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["test_*.py"]
