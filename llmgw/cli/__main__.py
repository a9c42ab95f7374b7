from llmgw.cli.main import main

main()
