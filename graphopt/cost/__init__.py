"""graphopt's cost model, one module per kernel family.

Each module prices its family's kernels on a HardwareSpec (graphopt.hardware) with the roofline
core in graphopt.cost_model; the passes ask these estimates at compile time which
implementation to use. Nothing here launches a kernel."""
