"""`dittrain plan`: what fits a GPU, how fast it trains and how long it takes, before anything runs.

    planner.py     the command: candidates, their memory and speed, the pick and its config file
    footprint.py   device memory of one training step, predicted (activation_table.json, measured)
    throughput.py  training speed from what bench/gpu_train.py measured
    probe.py       --probe: a few timed steps of a candidate on the actual device

The package itself imports nothing.
"""
