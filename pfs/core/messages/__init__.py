"""Typed RPC messages shared by clients and servers (``base`` declares, ``meta`` and
``data`` are the two services' methods, ``records`` the shared records, ``doc`` prints
``docs/rpc.md``'s tables)."""
