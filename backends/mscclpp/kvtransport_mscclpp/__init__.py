"""kvtransport backend ``mscclpp``: MSCCL++ connections (CudaIpc inside a host, IB0..IB7 between hosts).

Import-light: :mod:`.spec` is what the registry loads; :mod:`.native` finds and checks the MSCCL++ build
without importing it; :mod:`.select` decides the transport per peer; :mod:`.transport` does the work.
"""
