"""A stage replica on the network: the stage server, its per-kind frontends and its probes.

What ``omni-runtime stage`` runs in a stage pod, between routers (ZMQ over TCP) and the
stage core clients of ``engine.stage`` and ``diffusion.stage``.
"""
