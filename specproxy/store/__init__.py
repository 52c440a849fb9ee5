"""The SQLite store: frozen migrations, the one writer thread, and every query the rest asks of it."""
