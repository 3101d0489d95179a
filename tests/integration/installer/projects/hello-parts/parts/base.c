int hello_base(void) { return 40; }
