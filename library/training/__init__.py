"""The project's training core: one loop for every trainer (docs/training_core.md).

``trainer`` (the loop, its events, healing and the finish), ``build`` (a run from the options),
``run`` (what a run is made of), ``diffusion_loss`` (a batch's loss, a window's backward),
``families`` (SD 1.x/2.x, SDXL), ``config`` (the loop's typed options), ``options`` (the shared
command line). What trains is ``library.trainables``.
"""
