"""A target process for the GPU tests and benchmarks/gpu_bench.py (no pytest needed).

``TARGET % (transports, nbytes, on_gpu)`` is a script: an engine with those transports
lends ``nbytes`` of host memory, or of device memory when ``on_gpu``; it prints its segment
name and the region's address, then answers each ``hash`` line on stdin with the sha256
of the region (device memory copied to host first), and on any other line closes and
prints ``bye``.
"""

import textwrap

TARGET = textwrap.dedent("""
    import hashlib, sys
    from mooncake_plugins.config import EngineConfig
    from mooncake_plugins.transfer import TransferEngine, cuda, memory
    eng = TransferEngine(config=EngineConfig(transports=%r))
    host = bytearray(%d)
    dev = cuda.DeviceBuffer(len(host)) if %r else None
    region = eng.register_address(dev.address, dev.nbytes) if dev else eng.register(host)
    print(eng.segment_name, region.address, flush=True)
    for line in sys.stdin:
        if line.strip() != "hash":
            break
        if dev:
            cuda.copy(memory.address_of(host)[0], dev.address, dev.nbytes)
        print(hashlib.sha256(host).hexdigest(), flush=True)
    eng.close()
    if dev:
        dev.close()
    print("bye", flush=True)
""")
