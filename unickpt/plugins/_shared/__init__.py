"""Code several plugins share: device meshes, FSDP2 units, pipeline stages, the ZeRO partition.

Plugin modules import from here and from ``unickpt.plugins.base``, never from one another;
nothing here imports a plugin.
"""
