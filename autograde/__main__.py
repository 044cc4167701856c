from autograde.cli import main

raise SystemExit(main())
