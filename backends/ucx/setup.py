"""Builds the header-free C batch-put helper at install time (loaded with ctypes, not imported)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtransport_ucx._ucp_batch_ext", ["kvtransport_ucx/_ucp_batch.c"], optional=True)])
