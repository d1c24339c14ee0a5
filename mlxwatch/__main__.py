from mlxwatch.cli.main import main

main()
