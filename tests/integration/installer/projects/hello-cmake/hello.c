int hello_cmake(void) { return 42; }
