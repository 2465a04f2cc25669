"""The tools around the library: the `plait` command (cli.py) and what it runs, demo (and
demo_ddp), bench, doctor and the mesh testbed, with the helpers that start local ranks.

Nothing here is imported by `import plait`: the library (comm.py, the torch backend) never needs
these modules, and they pull in rich, torch and subprocess machinery it should not pay for."""
