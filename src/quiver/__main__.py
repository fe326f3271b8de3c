from quiver.cli import main

raise SystemExit(main())
