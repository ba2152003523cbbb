"""`python -m liteinfer.bench run|report`."""
from liteinfer.bench.cli import main

main()
