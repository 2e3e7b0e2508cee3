import sys

from deepspec.gpu_check.runner import main

sys.exit(main())
