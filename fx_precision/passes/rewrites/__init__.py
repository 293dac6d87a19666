"""Rewrites of a captured graph: gather emulation, source casts, dtype-following, covered narrowing, the engine contract."""
