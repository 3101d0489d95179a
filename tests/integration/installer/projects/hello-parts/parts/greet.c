#include "greet.h"
int hello_base(void);
int hello_greet(void) { return hello_base() + 2; }
