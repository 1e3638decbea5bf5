"""`python -m ditdata`: the same commands as the `ditdata` script (ditdata.cli).

The call sits under the `__main__` guard: fetch packs folders over a spawn pool, and a spawned
worker imports the parent's main module (as `__mp_main__`); the guard keeps it from running
the command line again."""

from ditdata.cli import main

if __name__ == "__main__":
    main()
