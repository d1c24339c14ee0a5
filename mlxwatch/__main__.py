from mlxwatch.cli import main

main()
