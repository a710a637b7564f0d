"""Built-in tasks: seeded prompt generators.  A task is any object with `prompt(index) -> Prompt`."""
