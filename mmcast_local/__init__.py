"""Running mmcast on one machine: the process supervisor behind `mmcast serve-local` (supervisor.py), the demo
conversation (demo.py), deterministic synthetic photos (synthetic_images.py) and the sub-commands this server
distribution adds to the client's `mmcast` command (commands.py, registered under the `mmcast.commands` entry-point
group).

Server side: it starts the services and builds models with torch and transformers, so it ships in the `mmcast`
distribution, never in `mmcast-client`.
"""
