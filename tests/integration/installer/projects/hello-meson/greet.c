#include <hello.h>
int greet(void) { return HELLO_VALUE; }
