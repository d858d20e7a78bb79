"""``python -m sim``: the simulator's command line (``sim.simulate``)."""

from sim.simulate import main

raise SystemExit(main())
