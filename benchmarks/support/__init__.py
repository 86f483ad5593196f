"""What every benchmark uses: statistics, result paths, process memory, the shared scenarios and images."""
