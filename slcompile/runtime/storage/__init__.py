"""Where the runtime's bytes rest and how they move: the tiers, the transfer engine and
the parts it is made of, the nvme arena with its I/O threads, directory and memory.

- ``engine``: ``TransferEngine``, the one interface the rest of the runtime stores and
  loads through (``get_engine``), made of a ``Ledger`` (``ledger``: entries by key and
  the memory they rest in), an ``NvmeStore`` (``nvme_store``) and a ``HostCopier``
  (``host_copier``: a host tier of its own memory, through the copy stream on a GPU),
  each holding what it needs.
- ``nvme``: ``NvmeArena``, one O_DIRECT file in a private directory (``offload_dirs``),
  read and written by I/O threads (``nvme_io``) into page-aligned memory
  (``page_buffers``); ``ranges`` allocates its byte ranges.
- ``tiers``: the tiers, the pinned host pool (``memory_limits``: what the machine lets
  it pin); ``handles``: transfer records.

Nothing here knows of graphs, plans or ops: the weights, stashes, gradient sinks and KV
stores of ``slcompile.runtime`` hold an engine and call it.
"""
