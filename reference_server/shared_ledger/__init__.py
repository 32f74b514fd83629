"""The shared ledger: an upstream's reservations kept in Redis, so that every gateway process
admits against one budget (``kvclient gateway --ledger redis://...``). Apart from
:mod:`reference_server.admission`, which is pure: this is its I/O.

- :mod:`.ledger`: :class:`~.ledger.RedisLedger`, the leases, the pub/sub wake-ups;
- :mod:`.connection`: reaching Redis (``redis://``, ``rediss://``, ``redis+sentinel://``);
- :mod:`.queue`: :class:`~.queue.SharedQueue`, the FIFO queue across processes;
- :mod:`.fair`: :class:`~.fair.SharedFairQueue`, fair shares across processes, deciding by
  :mod:`.fair_state` (the fair state as read, and the decision on it: pure);
- :mod:`.scripts`: the Lua scripts, each operation one atomic script; :mod:`.lua`, the Lua they
  all begin with; :mod:`.let_go`, :mod:`.prefixes` and :mod:`.holding`, the Lua of the holders
  let go lately, of the shared prefix blocks and of a holder's records and charge;
- :mod:`.view`: every gateway's holders as the peak rule counts them (pure);
- :mod:`.books`: the engine's ``/metrics`` scraped by one process per upstream for all.

Nothing is imported here: redis is needed only when a ledger is shared.
"""
