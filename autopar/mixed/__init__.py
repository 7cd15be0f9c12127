"""Plans over mixed GPU clusters (issue 42): the mixed workload and plan, their cost, search and
inventory. Each module is imported by its own name (no re-exports here)."""
