"""The discovery plane without I/O or clocks.

Nothing under this package imports asyncio, sockets or reads a clock: time comes in as a
keyword-only ``now`` (seconds, float) and results are returned as values. The daemon and the
simulator drive the same objects.
"""
