"""What the library asks the operating system and the command line, in one private place.

- `refimpl._system.proc`: facts about processes read from ``/proc`` (Linux): alive or not,
  state and parent, start time, environment, open files, signal handlers, boot id.
- `refimpl._system.disk`: making written files and directories durable (``fsync``).
- `refimpl._system.argtypes`: argparse ``type=`` checks shared by the trainer and chaos.

Each helper answers one question and says what it returns when the answer cannot be read
(not Linux, the process gone, no permission), so its callers decide what that means for them.
"""
