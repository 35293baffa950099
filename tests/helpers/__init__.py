"""Code the test files share that runs in the test's own process (models, crafted steps, process
lookups); what runs in other processes is in ``tests/workers``."""
