"""`python -m rollwire.demo`: the local stack learning the built-in task."""

from rollwire.demo.run import main

raise SystemExit(main())
