"""Transfer modes and scheduling: transport floors, new images, videos, the scheduler's step time."""
