// Compiles the executables' precompiled header (see CMakeLists.txt); no code of its own.
