"""The kvstore process: its socket loop (service), the client the scheduler and workers talk to it
with, the workers' mapping of its pools (attach), and how it sizes them (sizing).

The block store itself, with no sockets, is the top-level kvstore/ package (store, allocator,
block tables, prefix index, replay, pools); the scheduler runs the same core as its mirror.
"""
