"""The GPU half, checked: one prepared run over the CUDA paths (see README.md beside this file).

`scripts/gpu_check.sh OUT_DIR` on a GPU machine, `python -m deepspec.gpu_check --device cpu --out DIR`
for the CPU dry run of the same code paths at tiny sizes.
"""
