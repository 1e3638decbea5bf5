"""What ditdata and dittrain share, and nothing of either: the toolkit under both.

    errors.py   UserError, the one base of failures a user can act on; one_line()
    usercode.py code and weights the user brings: their failures the user's, their outputs checked
    files.py    atomic writes, digests, JSON files
    lock.py     one writer per output directory
    devices.py  device and precision choice
    cli.py      one-line errors for both command groups, FiniteFloat, -q/--quiet
    configfile.py  --config FILE (TOML/YAML/JSON options, under the command line's), --SECTION.KEY, TOML out
    progress.py    progress bars on a terminal, plain lines in a log file
    memory.py   out of GPU memory as one line that says what ran and what lowers it
    bytesize.py byte sizes written by people ("2GiB"), and shown to them
    dist.py     torchrun's environment and the process group's join/leave
    extras.py   "this needs the extra X" in one wording
    hub.py      the local Hugging Face cache; cache.py ditkit's own cache base
    lazy.py     a package's names imported on first use (its _EXPORTS table)

Light at import time: the standard library and click, except devices.py, which imports torch
(the command-line groups import it only inside the commands, so --help stays instant).
"""
