int hello_unused(void) { return 0; }
