from setuptools import setup

setup(cffi_modules=["ludo_c/build_ludo.py:ffibuilder"])
