from pdserve.kernels.cpu import main

main()
