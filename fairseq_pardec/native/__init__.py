"""The native kernels: C sources (products, a decoder call's layers, the best two scores, an
iteration's decisions), how they are built (``build``: at install time by setup.py, else at run
time into ``cache``), checked (``file_check``) and loaded (``library``).
"""
