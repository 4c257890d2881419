"""Kernels for gateeng's two plans.

`reference` holds plain-torch versions: the CPU invariant plan runs on them and
the tests compare the Triton kernels (`triton_*`, GPU or TRITON_INTERPRET=1)
against them. Importing this package never imports triton or flashinfer.
"""
