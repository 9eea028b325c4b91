"""The multi-turn and agentic generate functions (entry points ``multi_turn`` and ``agentic`` in
``miles.generates``): episodes whose every turn goes through the session server's turn logic."""
