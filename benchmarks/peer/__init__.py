"""mmcast beside vLLM on the same machine: workloads, capacity, stages and the report."""
