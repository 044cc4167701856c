from autograde.frontends.cli import main

if __name__ == "__main__":  # not when a grading process of `--jobs` imports it
    raise SystemExit(main())
