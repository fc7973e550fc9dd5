"""tensor/cuda_stub.c must match the declarations of tensor/cuda/cuda.h.

A build without CUDA links the stub in place of every CUDA entry point; a
declaration added to cuda.h without regenerating the stub would break that
build (and only that build), so this check runs in every build.
"""
import os
import subprocess
import sys

SOURCE = os.environ.get("NABLA_SOURCE_DIR",
                        os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
r = subprocess.run([sys.executable, os.path.join(SOURCE, "tensor", "cuda", "gen_stub.py"),
                    "--check"], capture_output=True, text=True)
print(r.stdout + r.stderr, end="")
sys.exit(r.returncode)
