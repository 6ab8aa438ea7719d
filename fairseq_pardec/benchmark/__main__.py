from fairseq_pardec.benchmark.runner import cli_main

cli_main()
