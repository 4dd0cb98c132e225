"""The model of a GPU worker that the simulator and the emulated worker share: its paged
VRAM/DRAM prefix cache (``prefixcache``, which speaks the engines' block events) and its
queueing and timing (``workermodel``). Not part of the sans-IO discovery plane (``core``): it
stands in for the engine, and may use the engine's event types."""
