"""`python -m dittrain`: the same commands as the `dittrain` script (dittrain.cli).

The call sits under the `__main__` guard: where worker processes are spawned (the streaming
loader on systems without fork), each imports the parent's main module (as `__mp_main__`); the
guard keeps it from running the command line again."""

from dittrain.cli import main

if __name__ == "__main__":
    main()
