"""Tools around the lab, not steps of the data path: benchmarks, the notebook report writer, CLIs."""
