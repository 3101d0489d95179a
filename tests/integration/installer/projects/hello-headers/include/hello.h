#define HELLO_VALUE 7
