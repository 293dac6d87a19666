"""Graph readers and the types every pass shares: nodes, kinds, annotation, units, casts, census. No rewrites."""
