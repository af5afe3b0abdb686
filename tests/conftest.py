"""Shared pytest configuration: one thread per process, deterministic torch where torch is used."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
