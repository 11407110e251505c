# The lab holds GPU probes and drivers, not tests: pytest never collects anything here, even when pointed
# at this folder (the suite's testpaths is tests/ already; this covers `pytest lab` and rootdir-wide runs).
collect_ignore_glob = ["*"]
